"""The judge: every rule that says whether a path's results are right, in one library.

Pure Python and numpy, no grpc and no generated protobuf modules, so each process that judges
imports it directly (docs/architecture.md#who-judges-what):

- `tensors`: raw OIP tensor bytes decoded to float64 (and back);
- `tolerances`, `compare`: a candidate's tensors against the reference, with the tolerance
  derived from the reference's own error (the rule of `torch._dynamo.utils.same`);
- `loss`: training loss curves;
- `divergence`: greedy generations token by token, and one served pair of them;
- `judge_errors`: the exception tree (each an INVALID_ARGUMENT or a precondition).
"""
