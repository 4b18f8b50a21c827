"""The fault layer: a loopback proxy in front of the S3/SQS endpoint (moto) that does to the real AWS
client what real S3 and SQS do at scale (:mod:`tests.faults.proxy`), and seeded fault plans that
decide, request by request, what it does (:mod:`tests.faults.plans`)."""
