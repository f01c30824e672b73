"""trace_verl works against verl 0.9.1's classes (server hooks, engine forward_step, registries)."""

SUPPORTED_VERL = ("0.9.1",)


def check_verl() -> str:
    import verl

    version = getattr(verl, "__version__", "unknown")
    if version not in SUPPORTED_VERL:
        raise RuntimeError(
            f"trace_verl supports verl {', '.join(SUPPORTED_VERL)}; this is verl {version}. "
            "Install the version it was checked against (pip install trace-fp4[verl])."
        )
    return version
