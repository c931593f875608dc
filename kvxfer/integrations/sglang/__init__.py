"""kvxfer as an SGLang prefill-decode transfer backend: `--disaggregation-transfer-backend
kvxfer`, added through SGLang's plugin mechanism (entry-point group `sglang.srt.plugins`,
`kvxfer.integrations.sglang.plugin`), no line of SGLang patched. Needs `pip install
'kvxfer[sglang]'`; the rest of kvxfer never imports SGLang.

The classes (`kvxfer.integrations.sglang.conn` and `.manager`) import SGLang; this package
does not, so the plugin's version check runs before any of SGLang's internals are touched.
docs/sglang.md has the flow, the recipe and what is and is not supported.
"""
