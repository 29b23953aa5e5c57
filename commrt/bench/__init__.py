"""``commrt bench``: nccl-tests-style bandwidth measurements of every backend, side by side."""
