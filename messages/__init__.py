"""Every typed message that crosses a mailbox, and the codecs. Imports nothing of ours."""
