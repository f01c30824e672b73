"""Test-only stand-in for `soundfile` (libsndfile), which this environment does not install.

SGLang 0.5.23's HTTP server imports it at start for its audio-transcription route
(`sglang.srt.entrypoints.openai.audio_chunking`); the slime tests only use /generate. Any use raises.
It goes on the PYTHONPATH of the SGLang server the slime tests start, nowhere else.
"""


def __getattr__(name):
    raise ImportError(f"soundfile.{name}: soundfile is not installed (a test-only stand-in; see tests/slime/stubs)")
