"""Agent sessions: the OpenAI and Anthropic chat APIs over a session, token-in-token-out."""
