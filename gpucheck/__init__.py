"""The GPU check: Arbiter's engine measured on an accelerator machine, prepared and rehearsed here.

The accelerator machine has no network and takes at most 64 MiB of files, so everything the check
needs travels in one ignored folder, ``.gpu-carry/`` (see :mod:`gpucheck.plan`): a trimmed
llama.cpp source tree (built there with CUDA on its 16 cores), the few Python wheels its image
lacks, and a *skeleton* of the default model (its metadata, tokenizer and tensor table, no
weights) from which a GGUF of the same shapes and types is written there. ``scripts/gpu-check
--rehearse`` runs the same pipeline here with a CPU build; ``scripts/gpu-check --device`` runs it
there. Its modules import only the standard library and :mod:`arbiter.llama_build` (standard
library too; numpy and llama.cpp's own gguf-py where they write models), because on the device
they run before the carried wheels are installed; what needs the engine runs as the project's own
commands in child processes (the engine's tests, ``arbiter bench engine``, :mod:`bench.agreement`).
"""
