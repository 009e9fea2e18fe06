"""The judge: every rule that says whether a path's results are right, in one library.

Pure Python and numpy, no grpc and no generated protobuf modules, so each process that judges
imports it directly (docs/architecture.md#who-judges-what):

- `tensors`: raw OIP tensor bytes decoded to float64 (and back);
- `tolerances`, `compare`: a candidate's tensors against the reference, with the tolerance
  derived from the reference's own error (the rule of `torch._dynamo.utils.same`);
- `repeats`: each side's run-to-run agreement (the reference's noise, the candidate's
  determinism);
- `loss`: training loss curves;
- `divergence`: greedy generations token by token, for a trial's prompts and for one served
  pair (`judge_pair`, the router's shadow); `oip_generations` reads them from OIP answers;
- `output_divergence`: the shadow's quick local rule on two answers' outputs;
- `capture_format`: the workload files the router writes and trials replay;
- `judge_errors`: the exception tree (INVALID_ARGUMENT); reading a workload raises
  switchyard's NotFound or FailedPrecondition.
"""
