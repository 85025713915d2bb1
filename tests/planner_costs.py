"""The draft planner's modelled step costs for tests (rayspec.engine.drafting.ModelledCosts; a config's
`draft_costs`): the planner weighs these instead of the wall clock, so the budgets it picks, and every
count a test asserts, are the same on a loaded machine as on an idle one.

A step costs 10 ms plus 0.5 ms per verified row, a proposer call 1 ms plus 0.5 ms per depth: drafts of
middling acceptance pay a little, so the budgets planned vary (0 to k) with what is accepted."""

MODELLED_COSTS = {"step_s": 0.010, "row_s": 0.0005, "propose_s": 0.001, "propose_depth_s": 0.0005}
