"""The `rayspec` command: fetch-model, generate, serve, plan, kuberay, train, bench offline, bench sweep,
bench serve.

It sits above both packages: the engine (`rayspec`, no Ray) and the Ray Serve layer (`deployments`),
which neither imports it nor, for rayspec, the other (tests/test_imports.py). Its modules: `main`
(the parser, one subcommand per function), `flags` (engine flags shared by the subcommands),
`local` (fetch-model, generate, configs-dir, train), `serve` (serve, plan, kuberay), `bench`."""
