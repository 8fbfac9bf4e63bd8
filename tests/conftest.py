"""Every test session decodes and partitions into its own cache folder (dpcore.task.data_cache.cache_dir)."""

import os
import tempfile

os.environ.setdefault("DPFL_CACHE_DIR", tempfile.mkdtemp(prefix="dpfl-test-cache-"))
