"""Model backends: llama.cpp behind the small protocol of base.py.

The engine, drafters and node speak only that protocol, so a test can put
tests/support/fakes.py's fake model where a GGUF would be; llama_process.py alone owns
llama.cpp's process-wide state (backend init, log callback, NUMA).
"""
