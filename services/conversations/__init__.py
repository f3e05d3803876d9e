"""Conversations service: durable chat history over gRPC (llmserve.v1.Conversations).

    __main__.py    process: config, signals           service.py     store + gRPC server + health + metrics
    server.py      thin servicer: validate, call the store, map errors to status codes
    validation.py  request checks and limits          pagination.py  opaque keyset page tokens
    store/         base.py (interface), sql.py (queries for both dialects), sqlite.py, postgres.py
    migrations/    versioned SQL per dialect, applied at start
"""
