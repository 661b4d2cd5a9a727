"""What the cluster tests share: the secret their nodes form the cluster with."""

from aenv.cluster.secret import ClusterSecret

SECRET = ClusterSecret("test-cluster-secret-0123456789")
