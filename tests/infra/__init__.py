"""Deployment: model packaging, CloudFormation templates, `arbiter deploy`, the Dockerfiles."""
