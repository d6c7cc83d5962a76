"""Building blocks of a decoder-only model: a family's quirk is a parameter of a block, never a copy of it."""
