"""verl's `verl.plugins` entry point: verl imports this module (it does not call anything), so
importing it registers trace_verl. verl swallows plugin import errors at debug level; a failure here
is logged as an error instead, so a TRACE run never starts silently without its servers and engine."""

import logging

try:
    from . import register

    register()
except Exception:  # noqa: BLE001 - re-raised after logging; verl would hide it
    logging.getLogger("trace_verl").exception("trace_verl: registering with verl failed; TRACE is NOT active")
    raise
