"""The request path: socket, codec, table, keys, request ids and the methods served from memory."""
