"""Ray Serve layer for rayspec: OpenAI ingress -> verifier (LLMEngine) [-> proposer].

`serve run configs/default.yaml` or `import_path: deployments.app:build_app`.
Only this package imports Ray; rayspec/ stays Ray-free.
"""
