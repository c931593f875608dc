"""The plugin, as SGLang loads it: through the entry-point group `sglang.srt.plugins`, in a
fresh interpreter each time (SGLang loads plugins once per process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kvxfer.integrations.sglang import plugin


def _python(code: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_entry_point_adds_the_backend_everywhere_sglang_looks_it_up():
    done = _python(
        """
        import json
        from importlib.metadata import entry_points
        # The scheduler modules import get_kv_class before the plugins load.
        import sglang.srt.disaggregation.prefill as prefill
        import sglang.srt.disaggregation.decode as decode
        import sglang.srt.managers.disagg_service as service
        from sglang.srt.disaggregation import utils
        mooncake = utils.TransferBackend.MOONCAKE
        from sglang.srt.plugins import load_plugins
        load_plugins()
        backend = utils.TransferBackend("kvxfer")
        classes = {
            t.value: [
                m.get_kv_class(backend, t).__qualname__
                for m in (utils, prefill, decode, service)
            ]
            for t in utils.KVClassType
        }
        print(json.dumps({
            "entry_points": [e.value for e in entry_points(group="sglang.srt.plugins")],
            "classes": classes,
            "mooncake_kept": utils.TransferBackend("mooncake") is mooncake,
            "mooncake_class": utils.get_kv_class(mooncake, utils.KVClassType.SENDER).__qualname__,
        }))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "kvxfer.integrations.sglang.plugin:register" in out["entry_points"]
    assert out["classes"]["manager"] == ["KvxferKVManager"] * 4
    assert out["classes"]["sender"] == ["KvxferKVSender"] * 4
    assert out["classes"]["receiver"] == ["KvxferKVReceiver"] * 4
    assert out["classes"]["bootstrap_server"] == ["KvxferKVBootstrapServer"] * 4
    assert out["classes"]["kvargs"] == ["KVArgs"] * 4  # SGLang's own container
    assert out["mooncake_kept"] and out["mooncake_class"] == "MooncakeKVSender"


_PARSE = """
    import argparse, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import ServerArgs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--disaggregation-mode", "decode",
                              "--disaggregation-transfer-backend", "kvxfer"])
    print(args.disaggregation_transfer_backend)
"""


def test_the_command_line_takes_the_backend_once_the_plugin_loaded():
    done = _python(_PARSE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "kvxfer"


def test_without_the_plugin_sglang_refuses_the_backend():
    # SGLANG_PLUGINS whitelists plugins by name: none named so, kvxfer's does not load.
    done = _python(_PARSE, {"SGLANG_PLUGINS": "some-other-plugin"})
    assert done.returncode != 0
    assert "invalid choice: 'kvxfer'" in done.stderr


def test_an_unsupported_sglang_version_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.setattr(plugin.importlib.metadata, "version", lambda name: "0.4.0")
    with pytest.raises(
        RuntimeError, match=r"supports SGLang 0\.5\.23, found 0\.4\.0.*kvxfer\[sglang\]"
    ):
        plugin.register()


def test_the_supported_version_is_the_installed_one():
    assert plugin.check_sglang_version() in plugin.SUPPORTED_SGLANG
