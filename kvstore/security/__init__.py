"""Who is calling, and what they may touch: identities, credentials and the checks every
listening service applies (docs/security.md)."""
