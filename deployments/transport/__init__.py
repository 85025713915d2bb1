"""Between verifier and proposer: the RemoteProposer the engine drafts through, the direct TCP
channel and its binary wire format, and the pydantic models of the handle calls."""
