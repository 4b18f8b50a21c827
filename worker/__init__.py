"""The batch worker pool: decision jobs dropped in S3, announced on SQS, results written back to S3.

``queue`` receives, ``jobs`` runs one job (``formats`` reads it), ``pool`` keeps the worker processes
alive. It imports the core (``arbiter``) and no other entry point.
"""
