"""Device code: the model, its weights, the paged KV cache, attention, sampling and the model runner (a CPU is a valid
device). One concept per package; imports run only downward, in this order (tests/test_layering.py holds it):

| rank | package                        | owns                                                           |
|------|--------------------------------|----------------------------------------------------------------|
| 0    | batch.py                       | the scheduler's contract: a step's rows (BatchSpec)            |
| 1    | kernels/, distributed/         | torch reference, Triton and native C++ kernels; process groups |
| 2    | attention/                     | the step's metadata, the KV cache, the backends (chosen once)  |
| 3    | layers/                        | every block: linear and quantized linear, norm, rope, MLP, MoE |
| 4    | models/                        | the families over the shared decoder, and their registry       |
| 5    | loading/                       | config parsing, checkpoints, the bundled model's fetch         |
| 1    | sampling/                      | logits -> tokens: metadata, penalties, top-k/p, logprobs       |
| 6    | runner/                        | the step: inputs, forward, graphs, memory plan                 |

A package imports its own modules and those of lower ranks only; sampling/ stands beside the model stack and imports
nothing of it. Nothing here imports actors/ or frontend/. messages/ (the wire types) sits between rank 0 and the
rest: it imports batch.py alone of gpu/, and sampling/ reads its SamplingParams.
"""
