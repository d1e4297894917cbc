"""Agent programs the agent tests run (in agent worker processes): one that plays two turns with an observation
between them and logs what it was served, and ones that fail in each way user code can."""

from __future__ import annotations

import asyncio
import json
import os
import time

OBSERVATION = "=9;"  # what the agent adds between its turns (CharTokenizer characters)


async def two_turns(client, prompt_row):
  prompt = prompt_row["prompt"]
  first = await client.completions.create(model="policy", prompt=prompt, max_tokens=4, temperature=1.0,
                                          extra_body={"return_token_ids": True})
  text = prompt + first.choices[0].text + OBSERVATION
  second = await client.completions.create(model="policy", prompt=text, max_tokens=4, temperature=1.0,
                                           extra_body={"return_token_ids": True})
  with open(os.environ["STREAMRL_TEST_AGENT_LOG"], "a") as log:
    log.write(json.dumps(dict(prompt=prompt, turns=[first.choices[0].token_ids, second.choices[0].token_ids],
                              texts=[first.choices[0].text, second.choices[0].text])) + "\n")
  return first.choices[0].text + OBSERVATION + second.choices[0].text


async def raises(client, prompt_row):
  await client.completions.create(model="policy", prompt=prompt_row["prompt"], max_tokens=2)
  raise RuntimeError("the agent's own bug")


async def garbage(client, prompt_row):
  print("an agent that prints")
  return {"not": "a reward"}


async def hangs(client, prompt_row):
  await asyncio.sleep(3600)


async def blocks(client, prompt_row):
  time.sleep(3600)  # never yields to the event loop: only killing its process ends it


def not_async(client, prompt_row):
  return 1.0
