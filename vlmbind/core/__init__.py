"""The bottom layer: named errors, atomic writers and the readers of user files, the image policy, site names, the
token index, the command line's choices, the result contract and where the shipped weights live. It imports nothing
of vlmbind from the layers above."""
