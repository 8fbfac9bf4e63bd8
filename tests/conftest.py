"""Every test session decodes and partitions into its own cache folder (fl_app.task.data.cache_dir)."""

import os
import tempfile

os.environ.setdefault("DPFL_CACHE_DIR", tempfile.mkdtemp(prefix="dpfl-test-cache-"))
