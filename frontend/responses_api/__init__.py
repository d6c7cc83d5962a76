"""OpenAI's Responses API (`/v1/responses`), served as chat completions underneath (issue 34).

fields.py    the request body's fields, and those refused
items.py     input items -> chat messages; function tools -> chat tools
request.py   a body -> a ResponsesCall (a chat ParsedRequest and what the response echoes)
writer.py    a run's output text -> output items and the API's semantic stream events
store.py     ended responses in SQLite (WAL): retrieve, delete, input items, previous_response_id; bounded,
             opened lazily
db.py        the store's SQLite side: files (ours, private), schema, migration, statements, eviction by rows,
             age and bytes
endpoint.py  the routes, and runs (foreground, streamed, background) owned by the HTTP actor
"""
