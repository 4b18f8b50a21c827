"""Deployment as code: CloudFormation templates (``infra/cloudformation``), `arbiter deploy` and
`arbiter package-model`."""
