"""The vLLM engine: `engine` (VLLMEngine, AsyncLLM behind the Engine protocol), `config`
(VLLMEngineConfig), `router` (name@step adapters), `cpu_lora` (the worker extension vLLM loads by
name) and `loop_thread`. Importable without vLLM installed.

Nothing is exported here: `art_core.engine` exports VLLMEngine and VLLMEngineConfig.
"""
