# Issue 3/8: the step-stream RPC path over CUDA IPC (cuda-marked tests).
timeout 120 python3 -m pytest -q -rs -m cuda tests/test_step_streams.py
