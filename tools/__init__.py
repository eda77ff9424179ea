"""Repository tooling, run from a checkout (tasks.py, tests, skills, the image build): the appliance
(images, docker / torchrun command lines, pin drift) and the skills linter. Not part of the
installed pithtrain package: they read images/ and skills/ next to them."""
