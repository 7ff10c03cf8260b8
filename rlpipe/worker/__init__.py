"""The warm worker: one resident process per pipeline execution that runs the stages' work.

With `runtime.warm_worker: true` (the default) each stage process DVC starts is a thin client
(`rlpipe.runner`): it hands the stage to the execution's worker (`server`) and waits. The execution's
first stage validates params.yaml, then starts the worker; the worker checks every stage it is handed
(params, declarations, inputs) before it loads anything, and tracks it. The worker keeps torch and transformers
imported and holds the models the last stages loaded or wrote (`rlpipe.models.store`), keyed by the
identity of their checkpoint files, so a round's stages stop paying imports and model loads. The
stage's outputs are written exactly as a cold stage writes them (atomically, schema-checked), before the
client exits; DVC sees the same commands, deps and outs. `client` starts, finds and calls the worker.
"""
