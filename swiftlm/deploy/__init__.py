"""Deployments of SwiftLM on cluster managers.

``swiftlm.deploy.ray_serve`` (needs the ``ray`` extra) runs SwiftLM replicas under Ray Serve; ``affinity``
(no extra) is its request-to-prompt-prefix logic, importable without Ray.  Nothing else in swiftlm imports Ray.
"""
