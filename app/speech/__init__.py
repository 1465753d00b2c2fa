"""Speech out: Piper voices, the TTS process that speaks them, and serve's handle on that process.

Piper and espeak-ng are GPL-3.0 and an optional extra (`pip install 'hearth[tts]'`): nothing here imports them
until a voice is spoken, inside the TTS process (app.speech.worker); without them that process answers with a
clear error and the rest of Hearth runs as before.
"""
