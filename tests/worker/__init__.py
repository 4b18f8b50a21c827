"""The S3/SQS worker: job formats, jobs, the queue loop, the pool, faults, against moto."""
