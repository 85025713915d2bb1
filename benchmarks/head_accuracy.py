"""How often an EAGLE-3 head's first draft is the target's next token, and whether serving drafts
what training predicts.

usage: python benchmarks/head_accuracy.py HEAD_DIR PROMPT_FILE [N_PROMPTS]
       (PROMPT_FILE: a shared set name such as mt_bench, or any Spec-Bench / Q&A JSONL path)

Per prompt: the engine decodes 128 tokens greedily with a one-token chain (drafting recorded),
then one target forward over the finished conversation gives the features and the head predicts
every answer position teacher-forced, as in training (TTT step 1). Prints
- inference == teacher-forced: share of engine steps whose draft equals the teacher-forced top-1
  at that position (1.00 unless serving and training disagree on features or alignment);
- top-1 / top-2 / top-4 accuracy over all answer positions, teacher-forced.
"""

import sys

import torch

from rayspec.bench.prompts import load_prompts
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.eagle.data import FeatureExtractor
from rayspec.eagle.train import head_step, ttt_mask
from rayspec.engine.llm_engine import LLMEngine
from rayspec.model import loader
from rayspec.proposers import eagle as eagle_proposer
from rayspec.sampling.sampler import SamplingParams


def main(head_dir: str, prompt_file: str, num_prompts: int) -> None:
    model, tokenizer = loader.load_model("smollm2-135m-instruct")
    spec = SpeculativeConfig(method="eagle3", draft_model=head_dir, num_speculative_tokens=1, eagle_topk=1,
                             num_steps=1, eagle_prompt_lookup=0, adaptive=False)
    engine = LLMEngine(EngineConfig(model="smollm2-135m-instruct", speculative=spec, max_model_len=1024,
                                    max_num_seqs=1), model=model, tokenizer=tokenizer)
    head = engine.proposer.head
    drafted = []  # (tokens in the sequence when drafting, first draft token)
    draft = eagle_proposer.EagleProposer._draft

    def recording(self, reqs, last):
        drafted.append((len(reqs[0].token_ids), int(self.head.to_target(self.head.draft_logits(last)[0].argmax()))))
        return draft(self, reqs, last)

    eagle_proposer.EagleProposer._draft = recording
    extract = FeatureExtractor(model, head.config.aux_layers)
    same = steps = 0
    hits = {1: 0, 2: 0, 4: 0}
    positions = 0
    for prompt in load_prompts(prompt_file, num_prompts):  # a bundled set's name or a file
        drafted.clear()
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        out = list(engine.generate([ids], SamplingParams(temperature=0, max_tokens=128))[0].token_ids)
        full = ids + out
        ex = extract({"prompt_ids": ids, "output_ids": out})
        with torch.inference_mode():
            feats = ex["aux"].float()[None, :-1].to(head.compute_dtype)  # [1, T, 3H]: pair i = (features i, token i+1)
            next_ids = ex["ids"].long()[None, 1:]  # [1, T]
            T = next_ids.shape[1]
            cos, sin = head.rope(torch.arange(T)[None], head.compute_dtype)
            hidden = head_step(head, head.embed_tokens(next_ids).to(head.compute_dtype), feats, cos, sin, [[]],
                               ttt_mask(T, 1, torch.tensor([T])), first=True)
            top = head.to_target(torch.topk(head.draft_logits(hidden)[0], 4, dim=-1).indices)  # [T, 4]: pair i -> token i+2
        for length, token in drafted:  # the first draft predicts token `length`, from pair length-2
            if length < len(full):
                steps += 1
                same += int(top[length - 2, 0]) == token
        for i in range(len(ids) - 2, len(full) - 2):
            positions += 1
            for k in hits:
                hits[k] += full[i + 2] in top[i, :k].tolist()
    print(f"{prompt_file}: {steps} engine steps, inference == teacher-forced {same / steps:.3f}; "
          f"teacher-forced accuracy over {positions} answer positions: "
          + ", ".join(f"top-{k} {h / positions:.3f}" for k, h in hits.items()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 10)
