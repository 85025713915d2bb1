"""Speculation under a JSON schema, offline, concurrency 1, on SmolLM2-135M (no Ray).

usage: python benchmarks/structured_output.py [ROUNDS]

Eight extraction prompts written for this benchmark (not from the evaluation sets) ask for a JSON
object with a fixed schema. Engines, taking turns prompt by prompt: `base` (no speculation, the
schema enforced), `ngram` (k 5), `eagle3` (the default config's drafting), and `base_free` (no
schema, to show what the masks cost). Greedy, up to 128 tokens, 2 torch threads. Reports tok/s,
the ratio over `base`, acceptance length, whether each speculative output equals `base`'s token for
token, and how many outputs parse and fit the schema.
"""

import json
import sys
import time

import torch

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.model import loader
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.structured import StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "job", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "job": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"},
                                                                "maxItems": 4}}}
PEOPLE = [
    "Maria Lopez is a 34-year-old nurse from Seville who loves salsa dancing, gardening and crime novels.",
    "At 61, retired pilot Tom Becker still lives in Hamburg; he restores old radios and sails on weekends.",
    "Aiko Tanaka, 27, works as a game designer in Osaka. She climbs, paints watercolours and plays the cello.",
    "Born in Lagos 45 years ago, Chidi Okafor is an architect who runs marathons and collects jazz records.",
    "Priya Nair (19) studies physics in Bangalore and spends her free time on chess, robotics and poetry.",
    "Lars Eriksson is a 52-year-old fisherman from Tromso who carves wood and watches football.",
    "Emma Dubois, a 38-year-old chef in Lyon, bakes sourdough, hikes in the Alps and writes a food blog.",
    "Carlos Mendes from Porto is 70, a former teacher who grows grapes, plays guitar and feeds pigeons.",
]
EAGLE = dict(method="eagle3", draft_model="heads/smollm2-135m-eagle3", num_speculative_tokens=8, eagle_topk=2,
             num_steps=4, eagle_stop_prob=0.2, eagle_prompt_lookup=5)
CONFIGS = {"base": {"method": "none"}, "ngram": dict(method="ngram", num_speculative_tokens=5),
           "eagle3": EAGLE, "base_free": {"method": "none"}}


def fits(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(value) == set(SCHEMA["required"]) and isinstance(value["age"], int)


def main(rounds: int) -> None:
    torch.set_num_threads(2)
    model, tokenizer = loader.load_model("smollm2-135m-instruct")
    engines = {name: LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=SpeculativeConfig(**c),
                                            max_model_len=2048, max_num_seqs=4), model=model, tokenizer=tokenizer)
               for name, c in CONFIGS.items()}
    schema = StructuredOutput.json_schema(SCHEMA)
    prompts = [engines["base"].encode_chat([{"role": "user", "content": f"Extract name, age, city, job and hobbies "
                                                                         f"as JSON.\n\n{p}"}]) for p in PEOPLE]
    params = {name: SamplingParams(temperature=0, max_tokens=128, structured=None if name == "base_free" else schema)
              for name in engines}
    for name, engine in engines.items():  # warm-up
        engine.generate([prompts[0]], params[name])
        engine.stats = SpecDecodeStats()
    tokens = {n: 0 for n in engines}
    seconds = {n: 0.0 for n in engines}
    outputs: dict[str, list] = {n: [] for n in engines}
    names = list(engines)
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for name in names[(r + i) % len(names):] + names[: (r + i) % len(names)]:
                start = time.perf_counter()
                out = engines[name].generate([prompt], params[name])[0]
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out.token_ids)
                if r == 0:
                    outputs[name].append(out)
    base = tokens["base"] / seconds["base"]
    for name in names:
        stats = engines[name].stats.as_dict()
        same = all(a.token_ids == b.token_ids for a, b in zip(outputs[name], outputs["base"]))
        print(f"{name}: {tokens[name] / seconds[name]:.1f} tok/s, {tokens[name] / seconds[name] / base:.2f}x base, "
              f"acceptance length {stats.get('mean_acceptance_length', 1.0):.2f}, "
              f"{'' if name == 'base_free' else f'greedy_match {same}, '}"
              f"fits the schema {sum(fits(o.text) for o in outputs[name])}/{len(prompts)}, "
              f"{tokens[name] / rounds / len(prompts):.0f} tokens per answer")
    print("example:", outputs["eagle3"][0].text)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
