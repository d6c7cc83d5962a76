"""The HTTP frontend: OpenAI protocol (parsing, formatting), tokenizer, aiohttp server actor, CLI."""
