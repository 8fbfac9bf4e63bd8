"""A SuperNode that sends its replies but never their objects (arrays, metrics, configs): a broken or
hostile node, for tests. It is `dpfl_tools.supernode` with Flower's object push replaced by nothing, so the
SuperLink holds each reply with its objects announced and never delivered.

    python -m tests.withholding_supernode <dpfl_tools.supernode arguments...>
"""

import sys

from flwr.supernode import start_client_internal

from dpfl_tools import supernode


def push_nothing(objects, push_object_fn, **kwargs) -> None:
    """Stands in for Flower's `push_object_contents_from_iterable`: pushes none of `objects`."""


if __name__ == "__main__":
    start_client_internal.push_object_contents_from_iterable = push_nothing
    supernode.main(sys.argv[1:])
