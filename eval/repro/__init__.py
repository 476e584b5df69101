"""The reproduction study: does humanline close the gap between sparse/offline and online GRPO?"""
