"""The SGLang versions trace_sglang_plugin is written against.

Everything here that touches SGLang internals (quantization registry, MoE method interface, KV pool
write path, scheduler result processing, output streaming) was read from these exact versions. Any
other version is refused at plugin load, loudly, instead of patching code that may have moved.
"""

SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


class UnsupportedSGLangVersion(RuntimeError):
    pass


def sglang_version() -> str:
    import sglang

    return getattr(sglang, "__version__", "unknown")


def check_sglang_version(what: str = "trace_sglang_plugin") -> str:
    version = sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedSGLangVersion(
            f"{what} supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)} only; found SGLang {version}. "
            "It hooks SGLang internals that change between releases: port and re-test it before use."
        )
    return version
