"""The `rayspec` command: fetch-model, generate, serve, plan, kuberay, train, bench offline, bench sweep,
bench serve.

It sits above both packages: neither the engine (`rayspec`, no Ray) nor the Ray Serve layer
(`deployments`) imports it, and `rayspec` imports nothing of `deployments` (tests/unit/test_imports.py
checks both). Its modules: `main`
(the parser, one subcommand per function), `flags` (engine flags shared by the subcommands),
`local` (fetch-model, generate, configs-dir, train), `serve` (serve, plan, kuberay), `bench`."""
