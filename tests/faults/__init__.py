"""The fault tooling, in one place: a loopback proxy in front of the S3/SQS endpoint (moto) that does
to the real AWS client what real S3 and SQS do at scale (:mod:`.proxy`); a fleet of queue consumers
behind it (:mod:`.fleet`); the seeded plans that decide, request by request, what it does
(:mod:`.plan`); the invariants every run is checked against (:mod:`.invariants`); the scenarios
the worker's fault tests share (:mod:`.scenarios`); and the two runners, the seeded campaign
(``python -m tests.faults.campaign``) and the black-box runs of ``arbiter work`` and ``arbiter
submit`` (``python -m tests.faults.blackbox``). The tests of the worker under faults stay with the
worker's tests (tests/worker/)."""
