"""The torch engine: `engine` (TorchEngine: intake, adapters, worker, lanes), `decoding` (Completion,
RowState, DecodeBatch), `decode_step` (the serving copy's decode step), `kv_cache`, `prefix_cache`,
`serving_weights` (the merged bf16 serving copy) and `streaming` (token streams).

Nothing is exported here: `art_core.engine` exports TorchEngine and Completion.
"""
