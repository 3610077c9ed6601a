"""What only ZeRO-3 needs: the partitioned build, momentum copies partitioned like their parameters, the first
step's check for parameters used while partitioned, and the pool pass's own prefetch trace."""
