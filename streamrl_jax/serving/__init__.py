"""The sampler as a service: an OpenAI-compatible HTTP server over the continuous-batching engine, streamed tokens,
token-exact transcripts of agent episodes."""
