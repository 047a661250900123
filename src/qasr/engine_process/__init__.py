"""The server's engines in a process of their own, and the client the server talks to them through."""
