"""Application builder (Ray Serve LLM style): `import_path: deployments.app:build_app`, `args: {...}`.

colocated:      OpenAIIngress -> Verifier (engine + in-process proposer)
disaggregated:  OpenAIIngress -> Verifier (engine + RemoteProposer) -> Proposer

Python handle API (from a driver connected to the cluster, or from another deployment):

    from ray import serve
    from deployments.protocol import GenerateRequest
    h = serve.get_app_handle("rayspec")
    resp = h.generate.remote(GenerateRequest(prompt="Hello", max_tokens=32, temperature=0)).result()
    for chunk in h.options(stream=True).generate_stream.remote(GenerateRequest(prompt="Hi", max_tokens=8)):
        print(chunk.delta_text, end="")
"""

from __future__ import annotations

from ray.serve import Application

from deployments.config import AppArgs, load_app_args
from deployments.ingress import OpenAIIngress
from deployments.proposer import Proposer
from deployments.verifier import Verifier


def build_app(args: dict | AppArgs | None = None) -> Application:
    cfg = load_app_args(args)
    plain = cfg.model_dump(mode="json")  # what travels to the replicas
    proposer = None
    if cfg.topology == "disaggregated":
        proposer = Proposer.options(**cfg.proposer_options()).bind(plain)
    verifier = Verifier.options(**cfg.verifier_options()).bind(plain, proposer)
    return OpenAIIngress.options(**cfg.ingress_options()).bind(plain, verifier)
