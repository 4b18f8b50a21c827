"""Deployment as code: CloudFormation templates (``infra/cloudformation``) and `arbiter deploy`."""
