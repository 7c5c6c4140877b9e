"""An OpenAI-compatible HTTP server: `python -m nbmoe.server -m model.gguf [-np N]`.

protocol.py checks requests and builds the replies' JSON, stops.py cuts the text at stop
strings, slots.py runs the engine for the requests (one worker thread, the generating slots
decoded as one batch), app.py holds the routes (FastAPI), __main__.py the command line.
"""
