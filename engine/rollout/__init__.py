"""The engine side of a rollout: follow the pod's annotations, fetch, hot-reload, report."""
