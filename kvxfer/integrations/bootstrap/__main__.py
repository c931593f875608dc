"""Command line: `python -m kvxfer.integrations.bootstrap --host H --port P` runs a bootstrap
service until interrupted (the secret, if any, from the environment variable
KVXFER_BOOTSTRAP_SECRET)."""

from __future__ import annotations

import argparse
import logging
import os
import threading
from collections.abc import Sequence

from kvxfer.integrations import bootstrap
from kvxfer.integrations.bootstrap.schema import SECRET_ENV
from kvxfer.integrations.bootstrap.server import BootstrapServer


def main(argv: Sequence[str] | None = None) -> None:
    """Serve on `--host` and `--port` (default 127.0.0.1:5690) until interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m kvxfer.integrations.bootstrap",
        description=(bootstrap.__doc__ or "The kvxfer bootstrap service").splitlines()[0],
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=5690)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = BootstrapServer(args.host, args.port, secret=os.environ.get(SECRET_ENV)).start()
    print(f"kvxfer bootstrap service on {server.address}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.close()


if __name__ == "__main__":
    main()
