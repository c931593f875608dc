"""The authenticated session layer, written once for every side channel kvxfer speaks.

No torch, no ZeroMQ, no I/O: `auth` holds the proofs and MACs, `protocol` a server and a
client that turn received frames into events and say which frames to send. The KV producer
and consumer, the encoder-cache producer and consumer, and the bootstrap service drive them.
"""
