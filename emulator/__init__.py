"""What SageMaker does around the container, run on this machine: the runtime API (InvokeEndpoint,
InvokeEndpointAsync, InvokeEndpointWithResponseStream) in front of `arbiter serve`, and Batch
Transform's data plane (`arbiter transform`). Configured from the same templates the real endpoint
is deployed from (``infra/``), so the two cannot drift."""
