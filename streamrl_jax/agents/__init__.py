"""Agent programs as the source of samples: loading and playing a user's agent program against the policy served
over the OpenAI API (program), its episodes as a sampler's samples (rollouts), and its held-out evaluation
(evaluation). Environments the engine calls as tools in multi-turn rows stay in `envs/`."""
